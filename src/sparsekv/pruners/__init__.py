"""Second-stage pruners applied to any selector's candidates (Twilight top-p)."""
