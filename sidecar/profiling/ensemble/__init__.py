"""Ensembles replayed as their graph: the steps of `ensemble_scheduling`, in dependency order."""
