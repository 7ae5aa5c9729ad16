"""The mode chooser (``TrainStep``), its bound loop spelling and the split it keeps between calls."""
