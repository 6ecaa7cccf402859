"""The report: its sections, the HTML and Markdown blocks they are written in, and the page assembled from them."""
