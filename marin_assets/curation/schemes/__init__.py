"""The URI schemes a source may name, one module each; `registry.scheme_of` finds a URI's scheme."""
