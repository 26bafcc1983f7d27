"""lab: experiments, measurement tools and their records; not shipped (the packages are compiler and ninfer_gen)."""
