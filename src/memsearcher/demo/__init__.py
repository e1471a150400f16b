"""The offline demo: a model trained from scratch on a synthetic world (`run_demo`)."""
