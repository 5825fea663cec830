"""copt: a command-line optimization toolkit for large language models on GPU workstations and clusters."""

__version__ = "0.1.0"
