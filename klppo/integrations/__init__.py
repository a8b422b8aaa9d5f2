"""klppo's KL control inside other trainers (`klppo.integrations.trl.add_kl_control`)."""
