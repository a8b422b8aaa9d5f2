"""`controller_grid.py --plugin ablate_guard_low_side`: the KL guard without its low side."""
import math

from controller_ablations import guard_without

guard_without(low_margin=math.inf)
