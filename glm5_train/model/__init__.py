"""The GLM-5 model on megatron-core: config, layer specs, MLA layers, DSA, MTP, weights, counts."""
