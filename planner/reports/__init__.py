"""Reading a plan: explain, diff, the simulated timeline, plots and the text `stratagem plan` prints."""
