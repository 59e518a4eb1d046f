(function(){
var t=document.getElementById('node-table');if(!t)return;
var tb=t.tBodies[0],rows=Array.prototype.slice.call(tb.rows);
var q=document.getElementById('q'),p=document.getElementById('prec'),u=document.getElementById('unm'),c=document.getElementById('count');
function f(){var s=q.value.toLowerCase(),pv=p.value,uv=u.checked,n=0;
rows.forEach(function(r){var ok=(!s||r.textContent.toLowerCase().indexOf(s)>=0)&&(!pv||r.getAttribute('data-p')===pv)&&(!uv||r.getAttribute('data-u')==='1');r.hidden=!ok;if(ok)n++;});
c.textContent=n+' of '+rows.length+' nodes';}
q.addEventListener('input',f);p.addEventListener('change',f);u.addEventListener('change',f);
var ths=t.tHead.rows[0].cells;
Array.prototype.forEach.call(ths,function(th,i){th.addEventListener('click',function(){
var num=th.getAttribute('data-t')==='n',dir=th.getAttribute('data-d')==='a'?'d':'a';
Array.prototype.forEach.call(ths,function(h){h.removeAttribute('data-d');});th.setAttribute('data-d',dir);
function k(r){var cell=r.cells[i],v=cell.getAttribute('data-v');if(v===null)v=cell.textContent;if(num){var x=parseFloat(v);return isNaN(x)?-Infinity:x;}return v.toLowerCase();}
rows.sort(function(a,b){var x=k(a),y=k(b);return (x<y?-1:x>y?1:0)*(dir==='a'?1:-1);});
rows.forEach(function(r){tb.appendChild(r);});});});
f();
})();
