"""The paper's claims C1-C6, one module each, the tables they read (Figure 9's off-policy tables), the declared
comparisons of a sweep, and the scorecard that assembles them."""
