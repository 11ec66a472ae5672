"""The trainers of preference data: the reference passes (the family's base), the pair data path, DPO's losses, and
the DPO, KTO and reward-modelling config/trainer pairs. It imports ``core`` alone."""
