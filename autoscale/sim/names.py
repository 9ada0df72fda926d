"""The names the simulator's command line offers, importable without numpy or scipy (``modelplane``
starts in half the time when its help does not import the simulator). A test keeps them in step
with ``autoscale.sim.day.build_policy`` and ``autoscale.sim.replica.COLD_STARTS``."""

POLICIES = ("static_peak", "hpa", "knative_kpa", "ray_serve", "ray_serve_target_2", "aibrix_kpa",
            "modelplane_horizontal", "modelplane_two_axes", "modelplane_two_axes_predictive", "oracle")
COLD_START_KINDS = ("plain", "lazy_image", "warm_pool")
