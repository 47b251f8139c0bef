"""Interactive charts as Plotly figures, and self-contained HTML pages of them.

One module per chart kind, each with a `figure(...)` that returns a `plotly.graph_objects.Figure`
(for notebooks) and is what `perfsim chart KIND` and `perfsim report` write:

    whatif      best plan's throughput and time breakdown as hardware multipliers move (sliders)
    heatmap     best throughput over two knobs (tp x pp, ...), infeasible cells with the reason
    scaling     weak and strong scaling efficiency against nodes, published points overlaid
    memory      peak memory per plan, stacked by kind, against the device's capacity
    breakdown   exposed step time per plan, stacked by cause
    timeline    one simulated step, per stage and stream (the event simulator)
    validation  predicted against measured times from a measurement ledger, with +-10% bands

Only this package imports plotly; nothing on the predict or search path imports this package.
`perfsim.charts.page.write_page` writes one or more figures as one HTML file with plotly.js
embedded, readable offline.
"""

KINDS = ("whatif", "heatmap", "scaling", "memory", "breakdown", "timeline", "validation")
