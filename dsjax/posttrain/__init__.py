"""Post-training recipes (`posttrain.recipe`): stages of training, each a run of its own, chained
by their weights and scored by exact match (recipe). The top floor beside dsjax.train, whose
`run` trains each stage."""

from dsjax.posttrain.recipe import run

__all__ = ["run"]
