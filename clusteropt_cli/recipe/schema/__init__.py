"""The recipe schema: one pydantic model per task (extra="forbid"), one module per task.

Defaults live here, not in the CLI: a command passes only the flags the user typed, merged over the recipe.
"""

from clusteropt_cli.recipe.schema.base import Prediction, Strict, TrainingOptions
from clusteropt_cli.recipe.schema.distill import DistillRecipe
from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe
from clusteropt_cli.recipe.schema.serve import ServeRecipe
from clusteropt_cli.recipe.schema.train import TrainRecipe

RECIPE_MODELS: dict[str, type[Strict]] = {
    "train": TrainRecipe,
    "quantize": QuantizeRecipe,
    "serve": ServeRecipe,
    "distill": DistillRecipe,
}
AnyRecipe = TrainRecipe | QuantizeRecipe | ServeRecipe | DistillRecipe

__all__ = ["RECIPE_MODELS", "AnyRecipe", "DistillRecipe", "Prediction", "QuantizeRecipe", "ServeRecipe", "Strict",
           "TrainRecipe", "TrainingOptions"]
