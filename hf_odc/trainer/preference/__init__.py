"""The preference trainers: the reference passes as the family base, the pair data path, DPO's losses, and the DPO,
KTO and reward-modelling config/trainer pairs."""
