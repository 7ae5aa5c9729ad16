"""What both steps share: their options, the loss's check, the update, precision, microbatches, skips."""
