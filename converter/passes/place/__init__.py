"""The place stage: give every ``follow`` node a precision so that casts are fewest (min-cut or simple)."""
