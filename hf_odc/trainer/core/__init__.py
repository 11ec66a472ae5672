"""What every ODC trainer shares: the step loop and its config, the step and minibatch types, checkpoints, the
packed attention, the Mixture-of-Experts loss, the console, the library warnings silenced."""
