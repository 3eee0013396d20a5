"""What trainers import."""
