"""A checkpoint's vocabulary, pure: trees and their leaves, optimizer state, the user's model,
regions of tensors in files, equality of leaves, and what a run may ask for."""
