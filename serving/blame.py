"""Who an error answer is to blame on, as a replica tells the router.

Every request a client gets wrong is a 4xx, as MLflow's scoring server answers it, and no 4xx
counts against a replica (outlier ejection counts 5xx and failed connections only). One kind
of 4xx still says something about the *version* being served: the model's ``predict`` raised
on input that passed the model's own signature, which is what a broken version does to valid
traffic. A pyfunc replica marks those answers with ``X-Modelplane-Fault: model``; the router
counts them, with the 5xx, as the revision's errors, which the canary and the bake judge
(``serving.router.latency``). A model without a signature cannot tell a client's mistake from
its own bug, so none of its 4xx is marked.
"""

from __future__ import annotations

FAULT_HEADER = "x-modelplane-fault"
MODEL_FAULT = "model"
