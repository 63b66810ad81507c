"""dsa-train: the training job that shows what dsa's fused ops change (see __main__)."""
