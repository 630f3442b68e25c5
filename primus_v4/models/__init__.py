"""Model definitions (the math); parallelism and kernels are passed in from outside."""
