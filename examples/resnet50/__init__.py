"""ResNet v1.5 (ResNet-18 ... 200) with loopkit: ImageNet on TPU pod slices, digits on a CPU."""
