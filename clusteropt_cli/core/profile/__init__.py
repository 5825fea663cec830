"""copt profile: measure a model (infer/train step) or an OpenAI-compatible endpoint and name the bottleneck.

Plain functions and dataclasses (no typer, no rich): `profile_model`, `profile_endpoint`, `compare_to_prediction`.
Heavy libraries (torch, transformers, aiohttp, matplotlib) are imported inside the functions that need them.
"""

from clusteropt_cli.core.profile.expect import Comparison, FigureCheck, compare_to_prediction, load_expectation
from clusteropt_cli.core.profile.settings import EndpointSettings, ModelProfileSettings

__all__ = [
    "Comparison",
    "EndpointSettings",
    "FigureCheck",
    "ModelProfileSettings",
    "compare_to_prediction",
    "load_expectation",
]
