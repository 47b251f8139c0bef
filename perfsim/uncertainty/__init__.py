"""Profile numbers as ranges, conditioned on observations: predictions with their uncertainty.

ranges       what each profile number may be (explicit `range`, named `causes`, or a default width
             by provenance kind)
sampling     quasi-random draws over those ranges and the predictions of every draw
observations published results and measurements a profile names, as checks on a draw
posterior    the draws consistent with the observations, and what cannot be explained
"""
