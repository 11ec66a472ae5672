"""How the online trainers generate: one owner per mode and the chooser (``modes``), the decoding copies
(``decoders``) and their static loop, the policy's full weights, and the vLLM sync. It imports ``core`` alone."""
