"""refit core, what every path uses: the plan, config, weight sources, packing, bucket checks,
the broadcaster, the handshake and stats. Rooms below by where code runs; `errors` is the leaf."""
