"""Fixtures shared across test folders."""

import uuid

import pytest

# The machine's PostgreSQL (trust auth); CI runs on a machine that starts it before the session.
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "postgres"}


@pytest.fixture
def pg_database():
    """A throwaway database `marin_test_<random>`, dropped afterwards. A missing server fails the
    test with a clear message instead of skipping it: these tests are part of CI."""
    import psycopg2

    try:
        admin = psycopg2.connect(**PG, connect_timeout=5)
    except psycopg2.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {PG['host']}:{PG['port']} as user {PG['user']} "
                    f"(CI starts it; locally: service postgresql start): {exc}")
    admin.autocommit = True
    name = f"marin_test_{uuid.uuid4().hex[:12]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
