"""Rollout workers as Ray actors (rollout.placement="ray"; imports Ray): the actor (`actor`), the
object-store publisher (`publisher`) and the driver's group of actors (`group`)."""
