"""ResNet v1.5 (ResNet-18 ... ResNet-200) trained with loopkit: ImageNet on TPU pod slices, digits on a CPU."""
