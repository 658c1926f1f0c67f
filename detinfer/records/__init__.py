"""Records: run manifests, session records, token streams and .detkv files (what an output depends on, hashed),
re-execution and comparison (verify, replay) and the determinism self-test."""
