

def hide_dagster_notices() -> None:
    """Dagster's beta/preview notices about its own APIs (pipes sessions, pools, data versions) are
    not the user's to act on. Called by the CLI and by every process that loads the code location
    (run workers launched per partition included)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*is currently in (beta|preview).*")
