"""The model-API proxy: front ends for four provider protocols, engines, capture."""
