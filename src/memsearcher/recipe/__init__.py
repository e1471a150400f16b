"""Recipes: whole training runs from data to report, each resumable (the embedded agent's)."""
