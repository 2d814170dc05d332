// Draws every chart of the page from the JSON block: one plotly.js figure per
// element whose data-chart attribute names it.
(function () {
  var charts = JSON.parse(document.getElementById("europa-charts").textContent);
  var config = { responsive: true, displaylogo: false };
  document.querySelectorAll("[data-chart]").forEach(function (element) {
    var figure = charts[element.dataset.chart];
    Plotly.newPlot(element, figure.data, figure.layout, config);
  });
})();
