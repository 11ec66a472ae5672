"""What every ODC trainer shares: the step loop and its config, the step and minibatch types, the dataset trainers'
base, checkpoints, the packed attention, what activation checkpointing keeps and on which layers, the Mixture-of-Experts
loss, the console, the library warnings silenced, and the frozen reference with its PEFT checks. It imports no other
wing."""
