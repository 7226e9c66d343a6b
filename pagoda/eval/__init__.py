"""Quality evaluations (`pagoda eval ...`)."""
