"""The core: modules to stateless functions over stacked state, vmap, grad, Ensemble."""
