"""Independent per-request numpy references of the token table and the repack planner (the
scheduler-side implementation the engine used before its one worker path): the batched worker code
(``vtoken.side_cache``, ``vtoken.select``) is tested against them. Not shipped in ``vtoken/``."""
