"""Model architectures: SDNet classifiers, the MNIST demo and the CSC denoiser."""
