"""Recipes: one pydantic schema per task (extra="forbid"), loaded from YAML with key.sub=value overrides."""
