"""Pipeline steps: small, executor-free units that annotate a list of document rows."""
