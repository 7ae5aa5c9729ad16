"""The named metric reductions and the collectives that compute them over a mesh axis."""
