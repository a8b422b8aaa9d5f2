"""`controller_grid.py --plugin ablate_guard_momentum_reset`: the KL guard keeps the optimizer's momentum."""
from controller_ablations import guard_without

guard_without(reset_momentum=False)
