"""The cost model of a served checkpoint: what one request costs, measured rather than guessed.

A sweep (``costmodel.sweep``) runs closed-loop load over input length × output length ×
concurrency on the serving hardware; ``costmodel.fit`` fits
``latency_ms(i, o | c) = α_c·i + β_c·o + γ_c`` per concurrency level and picks the highest
concurrency that holds the latency SLO; ``costmodel.plot`` draws the evidence as a PNG.

One model unit is 1 ms of replica time at the chosen operating point, so a replica serves
1000 model units per second.
"""
