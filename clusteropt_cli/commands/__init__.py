"""Thin command modules: parse → validate → call core → render."""
