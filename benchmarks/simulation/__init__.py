"""The scheduler in simulated time on machines not at hand (scheduler/simulation): Neo's published
setups through the roofline cost model."""
