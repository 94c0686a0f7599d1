"""What people look at: plotly figures, HTML reports, the head view and the Panel dashboard."""
