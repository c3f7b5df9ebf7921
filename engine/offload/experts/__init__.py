"""The hot-expert cache as it runs: each routed layer's most popular experts in GPU slots, the rest
computed by the CPU where they are stored, the routing statistics that choose the slots."""
