"""Placement: the prefix index, the placement policy (routing, pool policy, cost model, CPU lending), the
router's view of the workers, and running a placed request across them. Imports nothing from router.api."""
