"""The discrete-event simulator driving the real schedulers in simulated time, over a roofline cost
model from a hardware profile. Plain Python, no torch."""
