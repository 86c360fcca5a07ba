"""One emulated server's concerns, one module each; ``testbed.emu.worker.Worker``
puts them together (each class here is a mixin on the worker: the state each
one owns is set by its ``_init_*`` and named in its docstring).

- ``peers``: connections, window broadcasts, acknowledgements, liveness;
- ``routing``: decide, dispatch, re-route (the residing server's side);
- ``aggregation``: gather the partials, record the layer, hand the token on;
- ``compute``: the participant's side on the modeled GPU stream;
- ``faults``: lost peers, custody of tokens, timeouts, failed tokens and the FAIL relay;
- ``requests``: requests at their home server, token by token;
- ``inrun``: the proxy model's real states and scores (``quality.inrun``).
"""
